"""Analysis helpers: capturing real K/V, bit-width statistics, relative-error buckets, timing."""
