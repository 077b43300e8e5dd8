"""The closed loop: rollouts, training, weight sync, and the iteration table."""
