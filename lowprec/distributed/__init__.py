"""DDP/FSDP2 glue on torch.distributed: launching, wrapping, gradient communication, distributed checkpoints."""
