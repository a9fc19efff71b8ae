"""Adapters between refitd and the frameworks around it.

Modules:

- `sources`: trainer-side sources: each rank publishes its local shards
- `quant`: quantized refit: publish the engine's quantized checkpoint format
- `lora`: LoRA adapters as refitd models: publish a PEFT adapter, the update info
- `connect`: which daemon an integration talks to
- `offload/`: offloaded MoE layers in a transformers model, driven by `refitd.experts`
- `vllm/`: refitd as a vLLM weight-transfer backend
"""
