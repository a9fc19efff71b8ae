"""Adapters between refitd and the frameworks around it.

- :mod:`refitd.integrations.sources`: trainer-side sources that publish each rank's
  local shards with their global placement (FSDP2 ``DTensor``, Megatron-style
  ``(name, local tensor, offset, global shape)`` entries, plain modules), never
  gathering a full tensor;
- :mod:`refitd.integrations.vllm`: refitd as a vLLM weight-transfer backend
  (``weight_transfer_config={"backend": "refitd"}``), registered through vLLM's
  ``vllm.general_plugins`` entry point.
"""
