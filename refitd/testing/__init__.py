"""Test fixtures that ship with refitd: toy engines and trainer layouts.

Not product code: the demo, the benchmarks and the test suite import them to build
models and publications without a real engine or trainer.

Modules:

- `engines`: toy inference engines with vLLM's parameter shapes and weight loaders.
- `layers`: vLLM's parallel layers, toy-sized, and the loaders that carve each rank's share.
- `checkpoints`: a toy model's Hugging Face checkpoint: names, full shapes, roles.
- `layouts`: trainer layouts (FSDP, Megatron TP/EP) published as reshard sources.
"""
