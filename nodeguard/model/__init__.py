"""Data nodeguard passes between sensing, policy and acting: immutable values."""
