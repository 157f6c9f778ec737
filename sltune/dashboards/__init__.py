"""Plotly dashboards, imported as sltune.dashboards: figure builders and the pages under /dashboard."""
