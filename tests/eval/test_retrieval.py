"""The retrieval task: answers exist only in the prefix, and scoring is exact match."""

import pytest

from kvfetcher.eval import retrieval


def test_probes_ask_for_records_of_the_context_at_each_depth():
    context, probes = retrieval.build(40, seed=3)
    lines = context.splitlines()[1:]
    assert len(lines) == 40 and [p.depth for p in probes] == list(retrieval.DEPTHS)
    assert f"is {probes[0].answer}." in lines[0] and f"is {probes[-1].answer}." in lines[-1]
    for p in probes:
        word = p.question.split("code for ")[-1].split(" is")[0]
        assert retrieval.record(word, p.answer) in context
        assert p.answer not in p.question  # only the prefix holds the answer


def test_contexts_differ_by_seed_and_repeat_for_the_same_seed():
    assert retrieval.build(10, seed=1) == retrieval.build(10, seed=1)
    assert retrieval.build(10, seed=1)[0] != retrieval.build(10, seed=2)[0]
    with pytest.raises(ValueError):
        retrieval.build(len(retrieval.WORDS) + 1)


@pytest.mark.parametrize("generated,ok", [
    (" 4821.", True), ("4821", True), ("\n4821 and more", True), (" 4822.", False),
    (" 48210", False), (" the code is 4821", False), ("", False),
])
def test_exact_match_takes_the_first_word(generated, ok):
    assert retrieval.exact_match(generated, "4821") is ok
