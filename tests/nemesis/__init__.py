"""A nemesis campaign: a fleet in network namespaces, faults at random from a printed seed, and a
checker that believes only what the nodes themselves wrote down (issue #14)."""
