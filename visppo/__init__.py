"""visppo: PPO for robot policies from camera images, with a memory-bounded update."""

__version__ = "0.1.0"
