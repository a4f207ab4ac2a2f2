"""Metal kernel sources of dflash2_mlx (package data: *.metal, read by dflash2_mlx.metal)."""
