"""tests/conftest.py's LONGEST_FIRST names files that exist: a renamed or moved file would silently drop out of the
order that keeps `make test`'s two workers busy to the end."""

from pathlib import Path

from tests.conftest import LONGEST_FIRST

REPO = Path(__file__).resolve().parents[1]


def test_longest_first_names_existing_test_files():
    missing = [p for p in LONGEST_FIRST if not (REPO / p).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_collection_starts_with_the_longest_files(request):
    order = list(dict.fromkeys(item.nodeid.split("::")[0] for item in request.session.items))
    collected = [p for p in LONGEST_FIRST if p in order]
    assert order[:len(collected)] == collected
