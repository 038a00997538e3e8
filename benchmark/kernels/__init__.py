"""Kernel benchmarks, the cost-model calibration and the dispatcher's choice over a measured grid."""
