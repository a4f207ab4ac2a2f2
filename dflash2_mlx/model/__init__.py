"""The models: the target behind one interface (`target`), its views over mlx-lm models
(`views`), the DFlash 2 drafter (`drafter`, `config`) and its kernels (`kernels`, the folder
`metal_kernels/`).
"""
