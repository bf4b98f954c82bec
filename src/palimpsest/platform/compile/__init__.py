"""Compiling a turn: the budget, the compiler (plan -> prompt within the budget), folding, compaction
epochs and the epoch's turn, context edits and what a turn retains."""
