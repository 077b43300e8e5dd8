from slugify import slugify


def test_lowercase():
    assert slugify("Hello") == "hello"


def test_collapses_separators():
    assert slugify("Hello,  World!") == "hello-world"
