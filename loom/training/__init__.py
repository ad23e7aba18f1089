"""Training: trainer loop, optimizer and clipping across groups, LR schedule, metrics."""
