"""Child process of the crash-consistency tests: appends steps until it is killed, printing each
acknowledgement (t and content hash) only after `Ledger.append` has returned, i.e. after the commit.

``mixed`` (a third argument) also makes every other kind of versioned write between the appends, as a serving
replica does: summaries and key embeddings of the new steps (``Runtime.enrich``), a rolling fold, and audited
turns (each records its plan; a turn in compaction epochs may record a boundary)."""

import sys

from palimpsest.platform.compile.budget import Budget
from palimpsest.platform.ledger import Ledger
from palimpsest.platform.types import Fold, StepRecord


def record(t: int) -> StepRecord:
    # Content varies in size so that kills land inside small and large writes alike.
    return StepRecord(t=t, kind="bash", action=f"cat file_{t}.py", observation=f"line {t}\n" * (1 + (t * 37) % 200))


def main() -> None:
    path, session = sys.argv[1], sys.argv[2]
    mixed = len(sys.argv) > 3 and sys.argv[3] == "mixed"
    led = Ledger(path, tokenizer="approx")
    led.create_session(session, "append until killed")
    rt = None
    if mixed:
        from palimpsest.platform import Runtime

        rt = Runtime(led, leases=False)  # the one writer (a lease held by a killed child would idle the next)
    t = led.count(session)
    out = sys.stdout
    while True:
        step = led.append(session, record(t))
        out.write(f"{step.t} {step.sha256}\n")
        out.flush()
        if rt is not None:
            rt.enrich(session)
            if t % 5 == 4:
                led.add_fold(session, "rolling", Fold(upto=t - 2, text=f"so far: {t - 1} files read", tokens=6,
                                                      producer="rule"))
            if t % 3 == 2:
                rt.turn(session, "pace", Budget(1500))
        t += 1


if __name__ == "__main__":
    main()
