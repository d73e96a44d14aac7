"""Tensor parallelism on ``torch.distributed``: the rank group (gloo on CPU, NCCL on CUDA), the launcher that
starts a command's ranks, and the collectives the model, attention statistics and the request API use."""
