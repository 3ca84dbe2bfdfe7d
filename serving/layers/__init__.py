"""Model building blocks that own a kernel choice or (later) a parallel split: linear, norm,
mHC, MLP/MoE, and attention/{kda,dsa}, the only code that knows the cache layout."""
