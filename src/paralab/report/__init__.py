"""What a person reads: figures (``plots.py``) and the HTML/Markdown report (``page.py``), drawn
from run directories only."""
