"""Stop sequences and sampling settings (backend-agnostic)."""

import pytest

from localheap.generation import SamplingParams, StopMatcher


def feed_all(stops, pieces):
    m = StopMatcher(stops)
    out, stopped = "", False
    for p in pieces:
        text, stopped = m.feed(p)
        out += text
        if stopped:
            return out, True
    return out + m.flush(), False


def test_stop_sequence_split_across_pieces():
    assert feed_all(["END"], ["hello E", "N", "D world"]) == ("hello ", True)


def test_partial_stop_is_released_when_it_does_not_complete():
    m = StopMatcher(["END"])
    assert m.feed("abc EN") == ("abc ", False)
    assert m.feed("x") == ("ENx", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(["b", "a"], ["xxab"]) == ("xx", True)


def test_no_stops_passes_through():
    assert feed_all([], ["a", "b"]) == ("ab", False)


@pytest.mark.parametrize("bad", [dict(max_tokens=-1), dict(temperature=-0.1), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
