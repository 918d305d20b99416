"""Which data-parallel rank serves a user: one rank per user, so one limiter per user.

With ``--data-parallel-size N`` every rank runs its own scheduler and its own limiter. A
user whose requests were spread over the ranks would get its rate once per rank; pinned
to one rank, all of its requests meet one limiter and its quota is exact.

Rendezvous (highest random weight) hashing: each (user, rank) pair gets a pseudo-random
score and the user goes to its highest-scoring rank. Growing from N to N + 1 ranks moves
only the users whose new rank scores highest (about 1 / (N + 1) of them); the others keep
their rank and with it their limiter state. The hash is BLAKE2b, the same in every
process and every run (Python's ``hash`` of a string is salted per process, and several
API-server processes must agree).
"""

from __future__ import annotations

import hashlib


def user_rank(user: str, ranks: int) -> int:
    """The rank in ``range(ranks)`` that serves ``user``. Cost: one small hash per rank."""
    if ranks <= 1:
        return 0
    key = user.encode("utf-8", "surrogatepass")
    best, best_score = 0, b""
    for rank in range(ranks):
        score = hashlib.blake2b(key, digest_size=8, salt=rank.to_bytes(8, "little")).digest()
        if score > best_score:
            best, best_score = rank, score
    return best
