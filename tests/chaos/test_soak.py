"""The chaos soak (see :mod:`tests.chaos.soak`).

``make test-chaos`` runs the long soak (marker ``chaos``, not in the normal
suite): ``SEED`` replays a schedule (a random one is drawn and printed
otherwise), ``CHAOS_SECONDS`` sets how long faults are injected (300), and
``CHAOS_TOPOLOGY`` picks ``server``, ``cluster`` or ``both`` (the default).
It runs three replica processes over six partitions, and kills, freezes and
stops them among its faults. The normal suite runs a short soak with a fixed
seed on the cluster, with its two replicas in the test process (fast to
start, no replica faults). Both run a conversation of 2,000 turns within the
faults.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from tests.chaos.soak import REPLICA_WEIGHTS, Soak, SoakConfig

SEED = int(os.environ.get("CHAOS_SEED") or secrets.randbelow(1_000_000))
SECONDS = float(os.environ.get("CHAOS_SECONDS") or 300)
TOPOLOGIES = {
    "server": ["server"],
    "cluster": ["cluster"],
    "both": ["server", "cluster"],
}[os.environ.get("CHAOS_TOPOLOGY") or "both"]

REPLICA_FAULTS = set(REPLICA_WEIGHTS)  # killed, frozen and stopped replicas
SHORT_SEED = 20261129
SHORT_SECONDS = 55.0


@pytest.mark.chaos
@pytest.mark.timeout(SECONDS + 900)
@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_chaos_soak(topology: str, tmp_path: Path) -> None:
    config = SoakConfig(seed=SEED, seconds=SECONDS, topology=topology, replica_processes=3)
    report = await Soak(config, tmp_path).run()
    assert report.violations == [], "\n".join(report.lines())
    assert report.runs > 0
    assert report.faults.keys() & REPLICA_FAULTS, "no replica was killed, frozen or stopped"
    assert report.conversation is not None
    assert report.conversation.turns == config.conversation_turns


@pytest.mark.slow
@pytest.mark.timeout(SHORT_SECONDS + 80)
async def test_short_soak_with_a_fixed_seed(tmp_path: Path) -> None:
    config = SoakConfig(seed=SHORT_SEED, seconds=SHORT_SECONDS, topology="cluster")
    report = await Soak(config, tmp_path).run()
    assert report.violations == [], "\n".join(report.lines())
    injected = {kind for kind, n in report.faults.items() if n}
    assert injected >= {"worker-kill", "worker-stall", "duplicate-delivery", "lost-ack"}
    assert injected & {"stepdown", "leader-kill"}
    assert report.runs >= 20
    # The conversation ran all its turns, and kills and stalls hit its worker.
    talk = report.conversation
    assert talk is not None and talk.turns == config.conversation_turns == 2000
    assert talk.aimed.keys() & {"worker-kill", "worker-stall"}, talk.line()
