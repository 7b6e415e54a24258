"""``round_info``: what members tell each other, and what every member decides alike from it."""

from swarm.net.round_info import MAX_HELD, RoundInfo, common_reference, reference_moves


def _info(reference: str = "r1", quorum: int = 4, held: int = 0, in_view: int = 0) -> RoundInfo:
    return RoundInfo(10, 2, False, (1.0,), reference, "mean", "direct", quorum, held, in_view=in_view)


def test_an_info_survives_the_wire_and_implausible_counts_are_refused():
    info = _info(quorum=3, held=2, in_view=4)
    assert RoundInfo.from_msg(info.to_msg(), 1) == info
    before = ("quorum", "held", "codec", "in_view")
    older = {k: v for k, v in info.to_msg().items() if k not in before}  # a peer from before these fields
    assert RoundInfo.from_msg(older, 1) == _info(quorum=0, held=0)
    for bad in (-1, 1.5, True, "3", None, 1 << 30):
        for key in ("quorum", "held", "in_view"):
            assert RoundInfo.from_msg(info.to_msg() | {key: bad}, 1) is None, (key, bad)
    named = RoundInfo(10, 2, False, (1.0,), "r1", "mean", "direct", 4, 0, "int4")
    assert RoundInfo.from_msg(named.to_msg(), 1) == named
    for bad in ("int3", 4, None, ["int4"]):
        assert RoundInfo.from_msg(named.to_msg() | {"codec": bad}, 1) is None, bad


def test_the_reference_moves_only_with_every_member_each_expected_or_once_held_long_enough():
    four = [_info(quorum=4) for _ in range(4)]
    assert reference_moves(four, 4)
    pair = [_info(quorum=4), _info(quorum=4)]  # a group of four that split into pairs
    assert not reference_moves(pair, 2)
    # one member's view has a joiner the others do not see yet: nobody moves on (all read the same infos)
    assert not reference_moves([_info(quorum=3), _info(quorum=3), _info(quorum=4)], 3)
    assert reference_moves([_info(quorum=2), _info(quorum=0)], 2)  # a peer from before quorums
    # a reference kept through MAX_HELD rounds moves on at the next, whoever is missing
    assert not reference_moves([_info(quorum=4, held=MAX_HELD - 1), _info(quorum=4)], 2)
    assert reference_moves([_info(quorum=4, held=MAX_HELD), _info(quorum=4, held=0)], 2)


def test_the_common_reference_is_the_most_held_one_and_ties_go_to_the_smallest_id():
    assert common_reference([_info("b"), _info("a"), _info("b")]) == "b"
    assert common_reference([_info("b"), _info("a")]) == "a"
    assert common_reference([_info(""), _info("")]) == ""
