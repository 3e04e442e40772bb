"""What only the notebooks and `make demo` use: papermill runs (`runs`), the notebooks' readers (`study`), the
throughput probes (`probe`), the demo chain (`demo`) and its trained target (`demo_target`), the plotly reports
(`report`). Nothing below lab/ imports it."""
