"""What runs inside vLLM's worker processes: the worker extension (extension) and what it calls (LoRA slot
writes, in-place patches, shadow builds, MoE experts, read-back of packed weights).

Nothing here imports the replica side (loader/engines/vllm/ outside worker/): a worker gets
its orders through RPC method names and its bytes through the shared host copy.
"""
