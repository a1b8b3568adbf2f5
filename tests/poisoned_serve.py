"""`flover serve` (or `flover run`) with a sampler that fails for one request only: rows whose
seed is POISON_SEED raise. Stands in for a request-specific failure that validation did not
catch, to show that the engine ends that request alone (also under mpirun).

    python tests/poisoned_serve.py serve --model DIR ...
"""

import sys

import flover.runner.runner
from flover.apps.cli import main

POISON_SEED = 666_666
_real_sample = flover.runner.runner.sample


def poisoned_sample(logits, st, native=None):
    if bool((st.seed == POISON_SEED).any()):
        raise FloatingPointError("injected failure for the poisoned request")
    return _real_sample(logits, st, native)


if __name__ == "__main__":
    flover.runner.runner.sample = poisoned_sample
    sys.exit(main(sys.argv[1:]))
