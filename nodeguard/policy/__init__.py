"""Pure decision code: waterlines, gaps, ranking and the planner."""
