def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two closed intervals [start, end] share at least one point."""
    return a[0] < b[1] and b[0] < a[1]
