"""The scheduler's parts, one concept each (the facade is tessellm.scheduler.Scheduler):

  * request_scheduler: admission checks, priority classes, aging; the waiting queue;
  * batch_scheduler: which requests run this step under the token budget, the sequence cap
    and the KV pool, how many tokens each gets (chunked prefill, decode = 1), and which are
    preempted (truly preemptive priorities);
  * sla: the optional policy that moves the sequence cap with the measured ITL;
  * output: SchedulerOutput, the contract with the model runner.
"""
from tessellm.scheduling.batch_scheduler import BatchScheduler
from tessellm.scheduling.output import ScheduledRequest, SchedulerError, SchedulerOutput
from tessellm.scheduling.request_scheduler import RequestScheduler, Ticket
from tessellm.scheduling.sla import SLABatchSizer, SLAConfig

__all__ = ["BatchScheduler", "RequestScheduler", "SLABatchSizer", "SLAConfig",
           "ScheduledRequest", "SchedulerError", "SchedulerOutput", "Ticket"]
