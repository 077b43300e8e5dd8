from interval import overlaps


def test_disjoint():
    assert not overlaps((1, 2), (3, 4))


def test_touching_endpoints_overlap():
    assert overlaps((1, 2), (2, 3))
