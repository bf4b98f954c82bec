"""Child process of the crash-consistency test: appends steps until it is killed, printing each
acknowledgement (t and content hash) only after `Ledger.append` has returned, i.e. after the commit."""

import sys

from palimpsest.platform.ledger import Ledger
from palimpsest.platform.types import StepRecord


def record(t: int) -> StepRecord:
    # Content varies in size so that kills land inside small and large writes alike.
    return StepRecord(t=t, kind="bash", action=f"cat file_{t}.py", observation=f"line {t}\n" * (1 + (t * 37) % 200))


def main() -> None:
    path, session = sys.argv[1], sys.argv[2]
    led = Ledger(path, tokenizer="approx")
    led.create_session(session, "append until killed")
    t = led.count(session)
    out = sys.stdout
    while True:
        step = led.append(session, record(t))
        out.write(f"{step.t} {step.sha256}\n")
        out.flush()
        t += 1


if __name__ == "__main__":
    main()
