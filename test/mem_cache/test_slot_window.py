import pytest
import torch

from granikv.mem_cache.slot_window import Window, find_window, find_window_reference


def _masks(states: str):
    """``F`` free, ``M`` movable, anything else blocked."""
    free = torch.tensor([c == "F" for c in states])
    movable = torch.tensor([c == "M" for c in states])
    return free, movable


def test_docstring_example():
    free, movable = _masks("BFFMFBFFMMFF")
    assert find_window(free, movable, 4) == Window(1, 1)
    assert find_window(free, movable, 2) == Window(1, 0)  # a free pair, lowest start
    assert find_window(free, movable, 5) == Window(6, 2)
    assert find_window(free, movable, 6) == Window(6, 2)
    assert find_window(free, movable, 7) is None  # every 7-window holds slot 0 or 5


def test_none_when_free_slots_cannot_take_the_moves():
    free, movable = _masks("BMMMMF")
    assert find_window(free, movable, 2) is None  # one free slot in all: a 2-window needs 2
    free, movable = _masks("BMMFF")
    assert find_window(free, movable, 2) == Window(3, 0)
    with pytest.raises(ValueError, match="n >= 1"):
        find_window(free, movable, 0)


@pytest.mark.parametrize("seed", range(40))
def test_matches_reference_on_random_slot_states(seed):
    g = torch.Generator().manual_seed(seed)
    num = 17 + seed
    state = torch.randint(0, 3, (num,), generator=g)  # 0 free, 1 movable, 2 blocked
    free, movable = state == 0, state == 1
    free[0] = movable[0] = False  # slot 0: padding, blocked
    own = (torch.rand(num, generator=g) < 0.2) & (state == 2)
    own[0] = False
    for n in (1, 2, 3, 5, 8, 13):
        assert find_window(free, movable, n) == find_window_reference(free, movable, n), (seed, n)
        assert find_window(free, movable, n, own) == find_window_reference(free, movable, n, own)


def test_own_slots_are_usable_without_a_move():
    free, movable = _masks("BFFOOOFB")
    own = torch.tensor([c == "O" for c in "BFFOOOFB"])
    assert find_window(free, movable, 6) is None
    assert find_window(free, movable, 6, own) == Window(1, 0)
