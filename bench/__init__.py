"""`engine bench`: the workloads of shared/BENCHMARKS.md and the machine limits they are read
against. Nothing on the serving path imports this package; the `engine` command reaches it only
when `engine bench` runs."""
