def median(xs: list[float]) -> float:
    """The middle value; for an even count, the mean of the two middle values."""
    s = sorted(xs)
    return s[len(s) // 2]
