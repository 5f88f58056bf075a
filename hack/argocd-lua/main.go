// argocd-lua runs weightship's Argo CD Lua scripts in Argo CD's own Lua VM
// (github.com/argoproj/argo-cd/v3/util/lua), so tests see exactly what Argo CD does:
// its sandbox (no global os, open libraries off), its JSON decoding of the object, its
// "Pending deletion" short cut and its cleaning of returned objects.
//
// Input on stdin: a JSON array of cases {"kind": "health"|"discovery"|"action",
// "script": "...", "object": {...}}. Output on stdout: a JSON array of results in the same
// order, each {"result": ...} or {"error": "..."}.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/argoproj/gitops-engine/pkg/health"
	"github.com/argoproj/argo-cd/v3/pkg/apis/application/v1alpha1"
	"github.com/argoproj/argo-cd/v3/util/lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

type request struct {
	Kind   string         `json:"kind"`
	Script string         `json:"script"`
	Object map[string]any `json:"object"`
}

type response struct {
	Result any    `json:"result,omitempty"`
	Error  string `json:"error,omitempty"`
}

func run(req request) (any, error) {
	obj := &unstructured.Unstructured{Object: req.Object}
	switch req.Kind {
	case "health":
		// As the application controller does: overrides keyed by group/kind, libraries off.
		key := lua.GetConfigMapKey(obj.GroupVersionKind())
		overrides := lua.ResourceHealthOverrides{key: v1alpha1.ResourceOverride{HealthLua: req.Script}}
		return health.GetResourceHealth(obj, overrides)
	case "discovery":
		return lua.VM{}.ExecuteResourceActionDiscovery(obj, []string{req.Script})
	case "action":
		impacted, err := lua.VM{}.ExecuteResourceAction(obj, req.Script, nil)
		if err != nil {
			return nil, err
		}
		out := make([]map[string]any, 0, len(impacted))
		for _, r := range impacted {
			out = append(out, map[string]any{"object": r.UnstructuredObj.Object, "operation": r.K8SOperation})
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown kind %q", req.Kind)
}

func main() {
	input, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var reqs []request
	if err := json.Unmarshal(input, &reqs); err != nil {
		fmt.Fprintln(os.Stderr, "input:", err)
		os.Exit(2)
	}
	out := make([]response, 0, len(reqs))
	for _, req := range reqs {
		result, err := run(req)
		if err != nil {
			out = append(out, response{Error: err.Error()})
			continue
		}
		out = append(out, response{Result: result})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}
