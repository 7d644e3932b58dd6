"""The errors a run ends with, each with its own exit status (the CLI prints one line and exits with
it).

  2  bad input: a flag, a config value, a corpus, a workdir (`config.ConfigError`)
  3  preempted: SIGTERM/SIGINT, checkpoint saved (`train.preemption.EXIT_STATUS`)
  4  diverged: `optim.max_consecutive_skips` non-finite updates in a row (`Diverged`)
  5  checkpoints could not be written: the final save, or `checkpoint.max_failed_saves` in a row
     (`SaveFailed`)
  6  a peer process of a multi-process run was lost: one line names it, within
     ~1.2 x train.peer_timeout_s of the loss (`PeerLost`; train/peers.py ends the process, since its
     collectives may never return)
  7  out of memory: XLA's RESOURCE_EXHAUSTED while compiling or running the step, or (CPU) less
     host memory available than the planner predicts; one line with the planner's advice
     (`OutOfMemory`; with train.batch_size=auto, after one retry with twice the microbatches).
     A kernel OOM kill cannot be caught: the parent sees -9 (SIGKILL; a shell's 137)
No jax import here.
"""


class RunError(Exception):
  """A run that cannot go on; the message is one line for the user,
  `exit_status` the CLI's status."""
  exit_status = 1


class Diverged(RunError):
  exit_status = 4


class SaveFailed(RunError):
  exit_status = 5


class PeerLost(RunError):
  exit_status = 6


class OutOfMemory(RunError):
  exit_status = 7
