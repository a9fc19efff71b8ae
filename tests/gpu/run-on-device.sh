#!/usr/bin/env bash
# run-on-device.sh: the GPU tests and `refitd bench gpu`, in one command, on a GPU machine.
#
# Here, once, after `make install` (from the project root):
#   tests/gpu/run-on-device.sh --pack      # ../shared/tools/device-pack, plus what the GPU image
#                                          # lacks: pytest-asyncio, pytest-timeout, transformers
# There (the checkout and .device-pack/ sent along):
#   source .device-pack/setup.sh && tests/gpu/run-on-device.sh [bench gpu options]
#
# Three parts: tests (tests/gpu and the one install on the GPU, 360 s at most), bench (`refitd bench gpu`, 300 s at most),
# offload (`refitd bench offload --device cuda`, 180 s at most). RUN names the parts to run,
# comma-separated (default: all three); all three do not fit one 10-minute command, so run
# RUN=tests, then RUN=bench,offload.
# Results land in $OUT (else ./gpu-results): gpu.txt (nvidia-smi -L), pytest.txt, bench.txt,
# bench.json, offload.txt. The last lines printed are each part's summary line and exit
# status; the script exits non-zero when any part run failed.
# Written without a GPU: its first run on one is the first run of everything it runs.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)

if [ "${1:-}" = "--pack" ]; then
  cd "$repo" || exit 2
  ../shared/tools/device-pack "${@:2}" || exit $?
  py=.venv/bin/python
  pins=$($py -c 'import importlib.metadata as m; print(*(f"{p}=={m.version(p)}" for p in ("pytest-asyncio", "pytest-timeout")))')
  # shellcheck disable=SC2086  # two pins, split on purpose
  $py -m pip download -q --no-deps --only-binary=:all: -d .device-pack/wheels $pins || exit 1
  # transformers (engine_exact, the offload tests) with what it needs that the GPU image
  # lacks; what the image has (numpy, rich, torch's own dependencies) stays out.
  tf=$($py -c 'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null)
  if [ -n "$tf" ]; then
    tmp=$(mktemp -d)
    $py -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$tmp" "transformers==$tf" || exit 1
    for w in "$tmp"/*.whl; do
      case $(basename "$w") in
        numpy-*|rich-*|pygments-*|markdown_it_py-*|mdurl-*|typing_extensions-*|packaging-*|filelock-*|fsspec-*|idna-*) ;;
        *) cp "$w" .device-pack/wheels/ ;;
      esac
    done
    rm -rf "$tmp"
  fi
  ls .device-pack/wheels
  du -sh .device-pack
  exit 0
fi

python3 -c 'import msgspec' 2>/dev/null || { echo "run 'source .device-pack/setup.sh' first" >&2; exit 2; }
out=${OUT:-$repo/gpu-results}
mkdir -p "$out"
# Import refitd from the installed wheel (its native helpers are built there), not the checkout.
work=$(mktemp -d)
cd "$work" || exit 2
python3 -c 'import refitd, torch; print("refitd", refitd.__file__, "torch", torch.__version__, "cuda", torch.cuda.is_available())' | tee "$out/env.txt"
nvidia-smi -L > "$out/gpu.txt" 2>&1 || true

runs() { case ",${RUN:-tests,bench,offload}," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
tests=0 bench=0 offload=0
if runs tests; then
  timeout 360 python3 -m pytest -c "$repo/pyproject.toml" --rootdir "$repo" -p no:cacheprovider \
    -q -rs "$repo/tests/gpu" "$repo/tests/client/test_client_install.py" 2>&1 | tee "$out/pytest.txt"
  tests=${PIPESTATUS[0]}
fi
if runs bench; then
  timeout 300 python3 -m refitd.cli bench gpu --json "$out/bench.json" "$@" 2>&1 | tee "$out/bench.txt"
  bench=${PIPESTATUS[0]}
fi
if runs offload; then
  timeout 180 python3 -m refitd.cli bench offload --device cuda 2>&1 | tee "$out/offload.txt"
  offload=${PIPESTATUS[0]}
fi
echo "== for the closing note"
[ -f "$out/pytest.txt" ] && runs tests && echo "gpu tests: $(tail -n 1 "$out/pytest.txt") (exit $tests)"
[ -f "$out/bench.txt" ] && runs bench && echo "refitd bench gpu: $(tail -n 1 "$out/bench.txt") (exit $bench)"
[ -f "$out/offload.txt" ] && runs offload && echo "refitd bench offload --device cuda: $(tail -n 1 "$out/offload.txt") (exit $offload)"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$offload" -eq 0 ]
