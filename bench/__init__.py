"""The benchmarks: what the product costs, beside the floor and the peers (``make bench``)."""
