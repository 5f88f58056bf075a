-- Which weightship actions Argo CD offers for a ModelRollout, from its phase.
-- promote / promote-full: only while canary steps run (Progressing, Paused) and the canary is
--   not aborted; the controller ignores a promote while Healthy, aborted or still prefetching.
-- abort: while a canary is in flight (Prefetching, Progressing, Paused) and not yet aborted.
-- retry: only when the canary was aborted (status.abort or Aborted=True; phase Degraded), not
--   for an InvalidSpec, which only a spec change fixes.
local actions = {}
local phase = "Pending"
local aborted = false
if obj.status ~= nil then
  if obj.status.phase ~= nil then
    phase = obj.status.phase
  end
  if obj.status.abort ~= nil then
    aborted = true
  end
  if obj.status.conditions ~= nil then
    for _, condition in ipairs(obj.status.conditions) do
      if condition.type == "Aborted" and condition.status == "True" then
        aborted = true
      end
    end
  end
end

local stepping = (phase == "Progressing" or phase == "Paused") and not aborted
local inFlight = (stepping or phase == "Prefetching") and not aborted

actions["promote"] = {
  ["disabled"] = not stepping,
  ["displayName"] = "Promote (skip current step)",
  ["iconClass"] = "fa fa-fw fa-forward",
}
actions["promote-full"] = {
  ["disabled"] = not stepping,
  ["displayName"] = "Promote full (skip all steps)",
  ["iconClass"] = "fa fa-fw fa-fast-forward",
}
actions["abort"] = {
  ["disabled"] = not inFlight,
  ["displayName"] = "Abort (back to stable)",
  ["iconClass"] = "fa fa-fw fa-times-circle",
}
actions["retry"] = {
  ["disabled"] = not aborted,
  ["displayName"] = "Retry aborted canary",
  ["iconClass"] = "fa fa-fw fa-redo-alt",
}
return actions
