"""``KERA_FAILPOINTS``: what a process accepts at start, and what it refuses."""

from __future__ import annotations

import pytest

from kera import failpoints


def test_spec_names_places_and_actions():
    assert failpoints.parse("") == {}
    assert failpoints.parse("adoption.adopted=error") == {"adoption.adopted": [1, None]}
    assert failpoints.parse(" adoption.adopted=3*error ;") == {"adoption.adopted": [3, None]}
    assert failpoints.parse("adoption.adopted=pause(/tmp/x y)") == {
        "adoption.adopted": [1, "/tmp/x y"]}


@pytest.mark.parametrize("spec", ["no.such.place=error", "adoption.adopted=crash",
                                  "adoption.adopted", "adoption.adopted=pause()",
                                  "adoption.adopted=x*error"])
def test_unknown_places_and_actions_are_refused(spec):
    with pytest.raises(ValueError, match="KERA_FAILPOINTS"):
        failpoints.parse(spec)
