"""The Topology page: the GPUs' wiring drawn, as a topo -m matrix and in words; imports of other machines."""
