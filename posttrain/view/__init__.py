"""``posttrain view``: a run's recorded rollouts as one self-contained HTML page. The reader
(``rollout_view``) turns what ``sources/recorded.py`` wrote into plain records; the page
(``rollout_page``) draws them with one script, no network, no library. Above the sources (it reads
their recordings), below the loops (which draw it over their folder when a run ends)."""
