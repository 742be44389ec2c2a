"""The headline ratios of the shipped recipes (`run`, rows from `ratios`) and two runs of
one recipe compared figure by figure (`compare_runs`)."""
