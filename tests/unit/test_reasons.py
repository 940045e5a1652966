from podium import reasons


def test_seed_sentences_are_exact() -> None:
    # shared/seeds/000: the reasons the CLI, UI and tests read, word for word
    assert reasons.NO_NODES == "no node is connected to the control plane"
    assert reasons.NO_LABELS == "no online node carries every label this task requires"
    assert reasons.ALL_DRAINING == "every node that could run this task is draining"
    assert reasons.NO_ROOM == "no online node has enough free CPU or memory for this task"
    assert reasons.FULL == "every node that could run this task is full"
    assert reasons.NOT_ACCEPTED == "node did not accept assignment"
    assert reasons.TIMEOUT == "timeout"
    assert reasons.NO_LEASE == "the task is on no node and holds no lease"


def test_reasons_are_distinct_plain_sentences() -> None:
    values = [v for k, v in vars(reasons).items() if k.isupper() and isinstance(v, str)]
    assert len(values) == len(set(values))
    for v in values:
        assert v == v.strip() and not v.endswith(".") and v[0].islower()
