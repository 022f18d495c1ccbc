"""The reduce fix: FSDP2's gradient reduction in reduce_dtype on the releases that fail it."""
