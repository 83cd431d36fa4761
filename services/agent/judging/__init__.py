"""Judging an episode: grading the patch into the outcome reward, the PRM's step judgments
(their client and their scheduling), and how step scores shape the reward.
"""
