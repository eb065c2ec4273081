"""The execution graph (torch.fx), its fusion passes and its lowering to an ExecutionPlan."""
