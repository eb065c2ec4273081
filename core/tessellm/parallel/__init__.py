"""Tensor parallelism across processes: the group (torch.distributed), the leader's control
channel to its workers, the worker processes and their loop."""
