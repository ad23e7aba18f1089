"""Auto-parallel planner: FLOP, memory and time models of every layout, and a search."""
