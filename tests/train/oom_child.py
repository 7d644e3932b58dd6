"""A CLI run whose process may use only BUDGET GiB of address space beyond what it has mapped, for
tests/train/test_oom.py:

  python tests/train/oom_child.py {start,after_check} BUDGET train --config=... --workdir=...

`start`: the limit is set once jaxtrain is imported (a host whose memory is mostly taken when the
run starts). `after_check`: after each start-up memory check (plan/oom.check_host) passed, as when
another job takes the memory while the run compiles; XLA's own allocations then fail. The limit is
RLIMIT_AS (`ulimit -v`), which the kernel enforces on every mapping: the errors are real.
"""

import resource
import sys

import psutil

from jaxtrain import __main__ as cli
from jaxtrain.plan import oom
import jaxtrain.train.loop  # noqa: F401  the imports a run makes, mapped before the limit


def hold(budget_gib: float):
  room = psutil.Process().memory_info().vms + int(budget_gib * 2**30)
  resource.setrlimit(resource.RLIMIT_AS, (room, resource.getrlimit(resource.RLIMIT_AS)[1]))


def main(when: str, budget_gib: float, argv: list[str]) -> int:
  if when == "after_check":
    check = oom.check_host

    def check_then_hold(*args):
      check(*args)
      hold(budget_gib)

    oom.check_host = check_then_hold
  else:
    hold(budget_gib)
  return cli.main(argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1], float(sys.argv[2]), sys.argv[3:]))
