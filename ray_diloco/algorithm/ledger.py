"""Layer: algorithm (pure, no Ray). The token ledger (docs/algorithm.md section 7).

Per learner it keeps the data cursor (the number of tokens it has trained, across
incarnations) and, per fragment, the tokens that made it into the global model; the data pool
(algorithm/leases.py) says which ranges of the task's data each learner holds, has read, or
gave back when it left. A restarted learner resumes its leases at `resume_cursor`, so no data
is skipped or repeated; `violations()` proves no token was merged twice and none read twice.
The synchronizer checkpoints the ledger with its fragments, so a synchronizer restart keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.algorithm.leases import DataPool, Lease
from ray_diloco.algorithm.round_types import RoundClose


@dataclass
class LearnerAccount:
    cursor: int = 0
    merged: dict[int, int] = field(default_factory=dict)
    contributions: int = 0
    dropped: int = 0  # tokens of contributions the learner dropped unsent (a slow synchronizer)


class TokenLedger:
    def __init__(self, pool: DataPool) -> None:
        self.accounts: dict[str, LearnerAccount] = {}
        self.pool = pool

    def account(self, learner: str) -> LearnerAccount:
        return self.accounts.setdefault(learner, LearnerAccount())

    def join(self, learner: str, home: int | None) -> tuple[list[Lease], int]:
        """The leases a (re)joining learner reads and how far into the first it already is."""
        self.account(learner)
        return self.pool.join(learner, home)

    def record_progress(self, learner: str, cursor: int) -> list[Lease]:
        """A progress report; returns the leases that keep the learner supplied."""
        return self.pool.advance(learner, self.record_cursor(learner, cursor))

    def record_cursor(self, learner: str, cursor: int) -> int:
        """The learner's cursor, as a report states it (without handing out data)."""
        acct = self.account(learner)
        # Reports can arrive out of order across concurrency groups; the cursor only grows.
        acct.cursor = max(acct.cursor, cursor)
        return acct.cursor

    def record_dropped(self, learner: str, tokens: int) -> None:
        """The learner's count of tokens it trained but never got to offer (cumulative)."""
        acct = self.account(learner)
        acct.dropped = max(acct.dropped, tokens)

    def leave(self, learner: str) -> list[Lease]:
        """A learner left for good: its unread leases go back to the pool."""
        return self.pool.leave(learner)

    def record_merge(self, close: RoundClose) -> None:
        self.record_merged(
            close.fragment, [(c.meta.learner, c.num_tokens) for c in close.contributions]
        )

    def record_merged(self, fragment: int, merged: list[tuple[str, int]]) -> None:
        """Tokens of each (learner, tokens) contribution a round of `fragment` merged."""
        for learner, tokens in merged:
            acct = self.account(learner)
            acct.merged[fragment] = acct.merged.get(fragment, 0) + tokens
            acct.contributions += 1

    def resume_cursor(self, learner: str) -> int:
        return self.account(learner).cursor

    @property
    def tokens_trained(self) -> int:
        return sum(a.cursor for a in self.accounts.values())

    @property
    def tokens_dropped(self) -> int:
        return sum(a.dropped for a in self.accounts.values())

    def tokens_merged(self, fragment: int) -> int:
        return sum(a.merged.get(fragment, 0) for a in self.accounts.values())

    def merged_share(self, learner: str, fragments: Iterable[int]) -> float:
        """Tokens of `learner`'s work that reached the global model over the tokens it trained,
        averaged over `fragments` (every token trains every fragment); 0 before it trained."""
        acct = self.account(learner)
        ids = list(fragments)
        if acct.cursor <= 0 or not ids:
            return 0.0
        return sum(acct.merged.get(p, 0) for p in ids) / (len(ids) * acct.cursor)

    def violations(self) -> list[str]:
        """Fragments into which a learner merged more tokens than it ever trained, and data
        read twice or lost (the pool's books)."""
        out = self.pool.check()
        for name, acct in sorted(self.accounts.items()):
            for p, tokens in sorted(acct.merged.items()):
                if tokens > acct.cursor:
                    out.append(f"{name}: fragment {p} merged {tokens} > trained {acct.cursor}")
        return out

    def state_dict(self) -> dict[str, Any]:
        accounts = {
            name: {
                "cursor": a.cursor,
                "merged": a.merged,
                "contributions": a.contributions,
                "dropped": a.dropped,
            }
            for name, a in self.accounts.items()
        }
        return {"accounts": accounts, "pool": self.pool.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.load_state_dict(state["pool"])
        state = state["accounts"]
        self.accounts = {
            name: LearnerAccount(
                cursor=int(s["cursor"]),
                merged={int(p): int(t) for p, t in s["merged"].items()},
                contributions=int(s["contributions"]),
                dropped=int(s.get("dropped", 0)),
            )
            for name, s in state.items()
        }
