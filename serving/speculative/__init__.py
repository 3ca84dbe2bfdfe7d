"""EAGLE speculative decoding with the NextN draft (eagle) and its captured programs (graphs)."""
