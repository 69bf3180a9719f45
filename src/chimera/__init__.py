"""chimera: Chimera bidirectional pipeline parallelism for PyTorch.

The layers ``ir``, ``schedules``, ``passes``, ``validate``, ``sim``, ``viz`` and ``plan``
import no torch; ``models``, ``runtime`` and ``train`` do.
"""

__version__ = "0.1.0"
