"""``refitd bench``: benchmarks that print ratios measured side by side in one run.

Modules:

- `refit`: ``bench refit`` and the demo flow: trainer → two daemons → engine refit
- `trainer`: the trainer side of bench refit and the e2e tests: a layout published, its
  capture, the trainer process
- `synthetic`: the synthetic model bench refit moves, and its bit-exact check
- `transport`: ``bench transport``: 256 MiB pulls through each transport vs memcpy
- `plan`: ``bench plan``: plan a DeepSeek-V3-shaped refit for two trainer layouts
- `experts`: ``bench experts``: expert-cache policies vs Belady's optimum
- `prefetch`: ``bench experts --prefetch``: lookahead vs the demand-paging optimum
- `expertcases`: the cases both expert benches run: presets, pool sizes, timing
- `offload`: ``bench offload``: a Qwen3-MoE-shaped model decoding with offloaded experts
- `hosts`: ``bench hosts``: across simulated hosts, and discovery at scale
- `hostpaths`: the cross-host part of bench hosts: one refit per data path
- `hostwork`: a trainer or engine process on a simulated host (JSON lines on stdin)
- `simhosts`: simulated hosts: network + mount namespaces on one machine
- `vllm`: ``bench vllm``: refit a vLLM engine vs reloading it from disk
- `lora`: ``bench lora``: refit a LoRA adapter in a serving vLLM engine vs full refit and disk
- `inflight`: ``bench inflight``: a serving vLLM engine refitted in flight under load
- `delta`: ``bench delta``: refit by delta vs full refit of a model trained in bf16
- `deltamodel`: the parts of bench delta that run on one host or across a link
- `deltahosts`: ``bench delta --link-gbit R``: the delta bench across a slower link
- `deltamoe`: ``bench delta --moe``: a MoE model with ten thousands of expert tensors
- `fanout`: ``bench fanout``: many replicas on many hosts, direct pulls vs host mirrors
- `fanoutcases`: the cases of bench fanout on one fleet of hosts: straggler, kill, restart
- `fanoutwork`: the process bench fanout runs on each simulated host (JSON lines on stdin)
- `gpu`: ``bench gpu``: GPU memory through the daemon, each ratio against its baseline
- `hfexact`: Hugging Face models refitted through the daemon serve what fresh ones do
- `conditions`: the conditions a bench measures under, so its ratios compare alike
"""
