"""What refitd plans for a family's engine, as a signature two versions of the code can
compare: the capture of vLLM's own loaders on a meta twin, planned against one fixed
publication, reduced to every read, full read, pack spec and fill it makes.

Runs without an engine: a ``VllmConfig`` of the family's checkpoint folder, vLLM's
parallel groups set up for one process (gloo) or ``tp`` processes, the model class
built on the meta device as the worker builds its twin, and the planner's own
``capture_geometry`` / ``plan_transfer``. It imports only what refitd's planner
exported before issue 48, so the same module records the signatures of older code
(``python plan_signatures.py OUT.json`` with that code first on ``PYTHONPATH``); a
plan's fields renamed since are read under either name (:func:`_either`), and the
digest keeps the item names it was recorded under.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["TP2_FAMILIES", "plan_signature", "signatures", "write_families"]


def _sources(manifest: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, Any]:
    """Every source published whole by one trainer rank, laid out back to back at
    made-up addresses (a plan is pure: nothing is read)."""
    from refitd.reshard.slice_plan import Shard
    from refitd.reshard.transfer_plan import SourceInfo

    out, at = {}, 1 << 20
    for name, dtype, shape in manifest:
        el = dtype.itemsize
        out[name] = SourceInfo(
            shape, dtype, el, [Shard((0,) * len(shape), shape, "trainer", at, el)]
        )
        at += max(1, torch.Size(shape).numel()) * el
    return out


def _either(obj: Any, name: str, old: str) -> Any:
    """``obj.name``, or ``obj.old`` on a planner from before the field was renamed."""
    return getattr(obj, name) if hasattr(obj, name) else getattr(obj, old)


def _copy(c: Any) -> str:
    """A recorded copy by its fields (a cast chain only where there is one: the
    planner before issue 48 had none)."""
    fields = (
        c.src_name,
        c.op_chain,
        c.param_name,
        c.dest_offset,
        c.dest_shape,
        c.dest_stride,
        str(c.dest_dtype),
    )
    casts = getattr(c, "casts", ())
    return repr((*fields, tuple(str(d) for d in casts)) if casts else fields)


def plan_signature(
    vllm_config: Any, manifest: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> dict[str, Any]:
    """Capture and plan ``manifest`` for a twin of ``vllm_config``'s model, as the
    worker does, and return what was planned: counts, wire bytes and a digest of
    every planned item (a change in any byte of the plan changes the digest)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from refitd.reshard.geometry import capture_geometry
    from refitd.reshard.transfer_plan import plan_transfer

    model_class, _ = get_model_architecture(vllm_config.model_config)
    with (
        set_default_torch_dtype(vllm_config.model_config.dtype),
        set_current_vllm_config(vllm_config),
        torch.device("meta"),
    ):
        twin = model_class(vllm_config=vllm_config, prefix="")
    capture = capture_geometry(twin, manifest, default_weight_loader)
    plan = plan_transfer(capture, _sources(manifest))
    reads = _either(plan, "reads", "segments")
    full_reads = _either(plan, "full_reads", "full_pulls")
    # The digests were recorded over these item names: they stay as they were.
    items = {
        "segments": [(s.session, s.src_addr, s.dst_byte, s.nbytes, s.param_name) for s in reads],
        "full_pulls": [
            (
                fr.src_name,
                [
                    (s.session, s.src_addr, s.dst_byte, s.nbytes)
                    for s in _either(fr, "reads", "segments")
                ],
                [_copy(c) for c in fr.copies],
            )
            for fr in full_reads
        ],
        "packs": [repr(p) for p in plan.packs],
        "fills": sorted(
            repr((f.param_name, f.dest_offset, f.dest_shape, f.dest_stride)) for f in capture.fills
        ),
        "fallback": sorted(plan.fallback),
        "unsupported": sorted(capture.unsupported),
    }
    digest = hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "reads": len(reads),
        "full_reads": len(full_reads),
        "packs": len(plan.packs),
        "fills": len(capture.fills),
        "copies": len(capture.copies),
        "unattributed": capture.unattributed,
        "unsupported": len(capture.unsupported),
        "wire_bytes": int(plan.bytes_planned()),
        "digest": digest,
    }


def _config(folder: Path, tp: int) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=128,
        enforce_eager=True,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
    )
    return args.create_engine_config()


def _init_parallel(rank: int, world: int, port: int, first: bool) -> None:
    """vLLM's groups for the current config (its expert-parallel group exists only
    for a MoE model, so the groups are made afresh for every family)."""
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    if first:
        init_distributed_environment(
            world_size=world,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
    else:
        destroy_model_parallel()
    initialize_model_parallel(tensor_model_parallel_size=world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _manifest(folder: Path) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    from safetensors import safe_open

    out = []
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_slice(name)
            dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[
                t.get_dtype()
            ]
            out.append((name, dtype, tuple(t.get_shape())))
    return out


def _offline(cache: str) -> None:
    """vLLM offline, and its architecture inspection in this process (as the engine
    tests run it: no CUDA here to protect), so a family costs no extra interpreter."""
    from vllm.model_executor.models import registry

    os.environ.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=cache,
    )
    if not torch.cuda.is_available():
        registry._run_in_subprocess = lambda fn: fn()


def _rank_main(
    rank: int, world: int, port: int, folders: list[str], cache: str, out: Any, job: int
) -> None:
    from vllm.config import set_current_vllm_config

    try:
        _offline(cache)
        # the CPU communicator names its shared-memory group after the launch
        os.environ["VLLM_DIST_IDENT"] = f"refitd-signatures-{port}"
        sigs = {}
        for i, folder in enumerate(folders):
            vc = _config(Path(folder), world)
            with set_current_vllm_config(vc):
                _init_parallel(rank, world, port, first=i == 0)
                sigs[Path(folder).name] = plan_signature(vc, _manifest(Path(folder)))
        out.put((job, rank, sigs))
    except BaseException as exc:  # the parent reports it; a silent child would hang it
        import traceback

        out.put((job, rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def signatures(jobs: list[tuple[list[Path], int]], cache: Path) -> dict[str, dict[str, Any]]:
    """``{folder name (+ '@tp<t>r<rank>' when tp > 1): signature}`` for each job
    ``(checkpoint folders, tp)``: every folder captured and planned for every TP rank,
    in a fresh process per rank. The jobs' processes run side by side."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for job, (folders, tp) in enumerate(jobs):
        port = _free_port()
        names = [str(f) for f in folders]
        for r in range(tp):
            args = (r, tp, port, names, str(cache), queue, job)
            procs.append(ctx.Process(target=_rank_main, args=args))
    for p in procs:
        p.start()
    got = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    out: dict[str, dict[str, Any]] = {}
    for job, rank, sigs in sorted(got, key=lambda g: (g[0], g[1])):
        tp = jobs[job][1]
        if isinstance(sigs, str):
            raise RuntimeError(f"rank {rank} of {tp} failed: {sigs}")
        for name, sig in sigs.items():
            out[name if tp == 1 else f"{name}@tp{tp}r{rank}"] = sig
    return out


def write_families(root: Path, names: list[str] | None = None) -> list[Path]:
    """The first checkpoint (A) of every family of ``test_vllm_families`` (or those
    ``names``), one folder each under ``root``, as the family tests write it: the same
    names, dtypes and shapes, in zeros. A plan reads no value, so the Hugging Face
    model is built on the meta device, not initialised (the test's slowest part)."""
    from test_vllm_families import FAMILIES, checkpoint_state
    from vllm_models import save_model

    out = []
    for family in FAMILIES:
        if names is None or family.name in names:
            with torch.device("meta"):
                state = checkpoint_state(family, 11, retie=False)
            zeros = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in state.items()}
            out.append(save_model(root / family.name, family.config, zeros))
    return out


TP2_FAMILIES = ["llama", "qwen3-moe", "qwen2-tied-qkv-bias"]
"""Families whose TP 2 plans are recorded too (one rank's twin per process)."""


def main(out: str, root: str) -> None:
    """Record every family's signature, TP 1 and (for ``TP2_FAMILIES``) TP 2, into ``out``."""
    base = Path(root)
    folders = write_families(base / "models")
    tp2 = [f for f in folders if f.name in TP2_FAMILIES]
    sigs = signatures([(folders, 1), (tp2, 2)], base / "vllm-cache")
    Path(out).write_text(json.dumps(sigs, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]
    main(sys.argv[1], sys.argv[2])
